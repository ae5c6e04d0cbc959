"""One run's wiring: providers, the step clock, the shutdown order, exit and SIGTERM hooks. Imports
bridges and below.
"""
