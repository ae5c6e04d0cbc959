# Stand-in for verl 0.7.1: only verl/utils/tracking.py, verbatim from its wheel (Apache-2.0).
