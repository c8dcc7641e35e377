"""Speed measurements, ours beside a peer in the same run, each module run from the
repository root (`python -m benchmarks.decode`, ...). README.md here says which module
measures what, how to run each, what a report must carry and how results/ names its
folders and files."""
