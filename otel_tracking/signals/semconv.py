"""Every ``ml.*`` name otel-tracking writes, in one place: span and log attributes, baggage keys,
resource attributes, event names and the step span.  The runtime imports these instead of spelling
a name out (the tests do spell them: they hold the names to what users see).  It imports nothing,
so any layer may use it."""

from __future__ import annotations

# Run identity: resource attributes of every process of a run, and the baggage keys that carry
# the identity to other processes (``ml.run.attempt`` only when > 1).
PROJECT = "ml.project"
EXPERIMENT = "ml.experiment"
RUN_ID = "ml.run.id"
RUN_ATTEMPT = "ml.run.attempt"
IDENTITY_KEYS = (PROJECT, EXPERIMENT, RUN_ID, RUN_ATTEMPT)
RANK = "ml.rank"
ROLE = "ml.role"

# The step: a span attribute, a baggage key, and the name of each step's root span on the driver
# (the phases of every process serving the step are its descendants; ML trackers skip it, since
# verl logs its own ``timing_s/step``).
STEP = "ml.step"
STEP_SPAN_NAME = "ml.step"
# The gauge that carries the step, first point of every per-step batch.
STEP_METRIC = "train.step"
# On the step point of a per-step batch only: the log() call's non-number values as JSON.
STEP_OTHERS = "ml.step.others"

# trace_state spans.
LANE = "ml.lane"
LABEL_PREFIX = "ml.label."
WEIGHT_VERSION = "ml.weight_version"
ENDED_BY = "ml.span.ended_by"  # set on spans that finish() ended while still open

# Events (log records) and their attributes.
GENERATIONS_EVENT = "ml.validation.generations"
STALL_EVENT = "ml.stall"  # a phase open past its bound (runtime/stalls.py)
CONTINUES = "ml.step.continues"  # on a step's second root (logged again after a phase), and its link to the first
ANATOMY_EVENT = "ml.step.anatomy"  # a step's anatomy/* values, at ml.step (runtime/anatomy.py)
PHASE = "ml.phase"  # a phase's name (a trace_state span's), where it is an attribute
BUCKET = "ml.bucket"  # where a share of a step went (runtime/anatomy.py), one of these but "enclosing":
PRODUCTIVE, OVERHEAD, WASTED, IDLE, ENCLOSING = "productive", "overhead", "wasted", "idle", "enclosing"
BUCKETS = (PRODUCTIVE, OVERHEAD, WASTED, IDLE, ENCLOSING)
REWARD_TABLE_EVENT = "ml.table.filtered_reward_counts"
EVENT_KEY = "ml.key"
EVENT_BACKENDS = "ml.backends"

# Who writes: the instrumentation scope of every span, log record and metric otel-tracking makes
# (``otel_tracking.__version__`` is this version; pyproject.toml says it too).
SCOPE_NAME = "otel_tracking"
SCOPE_VERSION = "0.1.0"
