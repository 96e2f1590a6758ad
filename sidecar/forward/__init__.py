"""Disaggregated layout: trainer-node daemons forward FP8 generations to inference nodes."""
