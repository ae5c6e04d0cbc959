from otel_tracking.cli import main

raise SystemExit(main())
