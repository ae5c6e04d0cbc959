"""Configuration: the settings read from arguments and the environment, resume records, where each
tracker writes, the run's config as trackers get it. Imports signals and compat.
"""
