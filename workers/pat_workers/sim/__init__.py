"""`pat simulate`: the planner under GPU (or measured) cost models, policies side by side. No torch (numpy for one fit).

hardware: StepCosts (a GPU model of a GPU and a model shape, or the engine's measured profile); measurements and
calibration: the published GPU measurements and the GPU model's parameters fitted to them; lengths: response
lengths; simulate: the event loop and the policies; report: iteration latency, the table, plots and JSON;
command: the `pat simulate` command line (a job YAML or a preset).
"""
