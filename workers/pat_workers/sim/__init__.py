"""`pat simulate`: the planner under GPU (or measured) cost models, policies side by side. Pure Python, no torch.

hardware: StepCosts (roofline of a GPU and a model shape, or the engine's measured profile); lengths: response
lengths; simulate: the event loop and the policies; report: iteration latency, the table, plots and JSON;
command: the `pat simulate` command line (a job YAML or a preset).
"""
