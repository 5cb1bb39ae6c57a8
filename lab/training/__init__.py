"""Training recipes for the EAGLE-style and DFlash drafters (`lab-train`): target-generated data, cached
target features, losses, the optimisation loop."""
