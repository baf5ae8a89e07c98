"""Names of the metrics that workers export and that the operator's PromQL and the dashboards read.

One place for them, so that a rename cannot silently break a query.
"""

PREFIX = "pat_"

# Generator pods (the engine). Labels: group (replica group, e.g. "0-1"), tp.
GENERATOR_REQUESTS_RUNNING = "pat_generator_requests_running"
GENERATOR_REQUESTS_WAITING = "pat_generator_requests_waiting"
GENERATOR_TP_SIZE = "pat_generator_tp_size"
GENERATOR_TOKENS = "pat_generator_tokens"  # counter: exported as pat_generator_tokens_total
GENERATOR_PREEMPTIONS = "pat_generator_preemptions"  # counter: requests sent back to the queue for want of KV blocks
GENERATOR_KV_CACHE_USAGE = "pat_generator_kv_cache_usage"  # label group: fraction of the KV blocks in use
GENERATOR_STEP_SECONDS = "pat_generator_step_seconds"  # histogram, label tp
GENERATOR_REGROUPS = "pat_generator_regroups"  # counter, label outcome: applied | fallback
GENERATOR_REGROUP_REQUESTS = "pat_generator_regroup_requests"  # counter, label mode: kv | recompute
GENERATOR_REGROUP_SECONDS = "pat_generator_regroup_seconds"  # histogram, label mode: kv | recompute | total
GENERATOR_GUARD_VERDICTS = "pat_generator_guard_verdicts"  # counter, label verdict: held | lost (controller pod)
GENERATOR_LAYOUT_EPOCH = "pat_generator_layout_epoch"

REGROUP_MODES = ("kv", "recompute")
GENERATOR_POLICY_VERSION = "pat_generator_policy_version"
GENERATOR_BATCHES = "pat_generator_batches"  # counter: rollout batches completed (the batch boundaries)
# What the operator's planner needs besides the queue depths (controller operator), per group or per pod:
GENERATOR_RUNNING_CONTEXT_TOKENS = "pat_generator_running_context_tokens"  # label group: KV tokens held, summed
GENERATOR_RUNNING_GENERATED_TOKENS = "pat_generator_running_generated_tokens"  # label group: their tokens so far, summed
GENERATOR_BATCH_OPEN = "pat_generator_batch_open"  # 1 while a rollout batch is generating
GENERATOR_BATCH_MAX_TOKENS = "pat_generator_batch_max_tokens"  # the open batch's response length cap
GENERATOR_RESPONSE_TOKENS = "pat_generator_response_tokens"  # histogram: finished responses' lengths
GENERATOR_PROFILE_STEP_SECONDS = "pat_generator_profile_step_seconds"  # labels tp, batch: T(tp, batch), refined
GENERATOR_PROFILE_CONTEXT = "pat_generator_profile_context_tokens"  # ... measured at this context per sequence
GENERATOR_PROFILE_KV_SECONDS = "pat_generator_profile_kv_seconds"  # label tp: step seconds per KV token beyond it
GENERATOR_REGROUP_COST = "pat_generator_regroup_cost"  # label term: fixed_seconds | kv_seconds_per_token
GENERATOR_PREFILL_COST = "pat_generator_prefill_cost"  # labels tp, term: seconds | seconds_per_token

# Generator pods of engine vllm: vLLM's own series, which the pod's /metrics re-exports as they are (the scrape adds
# namespace, pod, pat_job, pat_role), labelled engine (the data-parallel engine's index) and model_name.
VLLM_PREFIX = "vllm:"
VLLM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # fraction (0..1) of the engine's KV cache blocks in use
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"  # counter: exported as vllm:generation_tokens_total
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"  # counter: exported as vllm:prompt_tokens_total

# Trainer (rank 0). Label phase: generate | reward | train | sync | checkpoint.
TRAINER_ITERATION = "pat_trainer_iteration"
TRAINER_PHASE_SECONDS = "pat_trainer_phase_seconds"  # gauge: the last iteration's seconds per phase
TRAINER_REWARD_MEAN = "pat_trainer_reward_mean"
TRAINER_REWARD_STD = "pat_trainer_reward_std"
TRAINER_RESPONSE_TOKENS_MEAN = "pat_trainer_response_tokens_mean"
TRAINER_LOSS = "pat_trainer_loss"
TRAINER_KL = "pat_trainer_kl"
TRAINER_ENTROPY = "pat_trainer_entropy"
TRAINER_POLICY_VERSION = "pat_trainer_policy_version"
# counter: exported as pat_trainer_reward_failures_total; responses scored 0 as their reward raised or timed out
TRAINER_REWARD_FAILURES = "pat_trainer_reward_failures"
# The engine's sampled-token log-probabilities against the trainer's pi_old, over the last iteration's tokens.
TRAINER_ROLLOUT_LOGPROB_DIFF_MEAN = "pat_trainer_rollout_logprob_diff_mean"
TRAINER_ROLLOUT_LOGPROB_DIFF_MAX = "pat_trainer_rollout_logprob_diff_max"
TRAINER_ROLLOUT_KL = "pat_trainer_rollout_kl"  # k3 estimate of KL(engine || trainer)

TRAINER_PHASES = ("generate", "reward", "train", "sync", "checkpoint", "switch")  # switch: colocated sleep + wake

# The operator.
OPERATOR_RECONCILES = "pat_operator_reconciles"  # counter, label result: ok | error
OPERATOR_RECONCILE_SECONDS = "pat_operator_reconcile_seconds"  # histogram
OPERATOR_PODS_CREATED = "pat_operator_pods_created"  # counter
OPERATOR_GANG_RESTARTS = "pat_operator_gang_restarts"  # counter
OPERATOR_JOBS = "pat_operator_jobs"  # gauge, label phase
OPERATOR_API_ERRORS = "pat_operator_api_errors"  # counter, label verb: create | delete | patch
OPERATOR_REGROUP_PLANS = "pat_operator_regroup_plans"  # counter, label outcome: applied | unchanged | fallback | superseded | failed
OPERATOR_REGROUP_ATTEMPTS = "pat_operator_regroup_attempts"  # counter, label result: ok | error (each POST)
OPERATOR_PROMETHEUS_ERRORS = "pat_operator_prometheus_errors"  # counter, label reason
OPERATOR_REGROUP_DELAY_SECONDS = "pat_operator_regroup_plan_seconds"  # histogram: plan sent -> acknowledged


def response_token_buckets(max_seq: int, buckets: int = 32) -> tuple[int, ...]:
    """The upper bounds of GENERATOR_RESPONSE_TOKENS' buckets: linear up to max_seq. The operator's length predictor
    reads earlier responses' lengths at this resolution."""
    step = max(max_seq // buckets, 1)
    return tuple(range(step, max_seq + step, step))
