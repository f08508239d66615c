"""The prefetch role: :mod:`.prefetcher` decides which unit goes into which device slot, when."""
