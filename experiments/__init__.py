"""Experiment files run end to end: the plan of cells (`plan`), where the cells run (`backends`:
the simulator or a Ray cluster), running them (`run`) and the report (`experiment_report`).
Imports point one way: plan <- backends <- run <- experiment_report."""
