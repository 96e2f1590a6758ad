"""Engine side: attach/load logic shared by every engine, and the engine adapters."""
