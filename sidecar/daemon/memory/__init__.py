"""The daemon's memory: published generations, staging and the staging ring."""
