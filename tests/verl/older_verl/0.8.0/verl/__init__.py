# Stand-in for verl 0.8.0: only verl/utils/tracking.py, verbatim from its wheel (Apache-2.0).
