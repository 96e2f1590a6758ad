"""The daemon's settings: file, `REFITD_*` variables, flags; one frozen config."""
