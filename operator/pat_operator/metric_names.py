"""Names of the metrics that workers export and that the operator's PromQL and the dashboards read.

One place for them, so that a rename cannot silently break a query.
"""

PREFIX = "pat_"

# Generator pods (the engine). Labels: group (replica group, e.g. "0-1"), tp.
GENERATOR_REQUESTS_RUNNING = "pat_generator_requests_running"
GENERATOR_REQUESTS_WAITING = "pat_generator_requests_waiting"
GENERATOR_TP_SIZE = "pat_generator_tp_size"
GENERATOR_TOKENS = "pat_generator_tokens"  # counter: exported as pat_generator_tokens_total
GENERATOR_STEP_SECONDS = "pat_generator_step_seconds"  # histogram, label tp
GENERATOR_REGROUPS = "pat_generator_regroups"  # counter, label outcome: applied | fallback
GENERATOR_REGROUP_REQUESTS = "pat_generator_regroup_requests"  # counter, label mode: kv | recompute
GENERATOR_REGROUP_SECONDS = "pat_generator_regroup_seconds"  # histogram, label mode: kv | recompute | total
GENERATOR_LAYOUT_EPOCH = "pat_generator_layout_epoch"

REGROUP_MODES = ("kv", "recompute")
