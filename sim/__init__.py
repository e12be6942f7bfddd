"""The simulator and its cost models: the cluster on virtual time (`simulator`), one engine
replayed in process (`replay`), the fitted cost model (`cost_model`) and its calibration on
this machine (`calibration`), and the in-process batching comparison (`batching_comparison`). No Ray."""
