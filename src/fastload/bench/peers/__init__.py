"""The peers' set-ups: how each tool users would pick instead of fastload opens a dataset,
shared by the end-to-end and component benchmarks."""
