"""The command line: `refitd serve|status|plan|keygen|demo`."""
