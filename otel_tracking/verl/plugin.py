"""verl's ``verl.plugins`` entry point: ``import verl`` (>= 0.9) imports this module in every
process.  It does nothing unless ``OTEL_TRACKING_VERL=1``."""

from otel_tracking.verl import install, switch

if switch.switched_on():
    install(f"{switch.SWITCH}=1")
