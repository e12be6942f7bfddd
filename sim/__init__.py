"""The simulator and its cost models: the cluster on virtual time (`simulator`), one engine
replayed in process (`replay`), the fitted cost model (`cost_model`) and its calibration on
this machine (`calibrate`), and the in-process batching comparison (`compare`). No Ray."""
