from otel_tracking.cli.main import main

raise SystemExit(main())
