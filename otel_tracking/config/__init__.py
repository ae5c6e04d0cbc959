"""Configuration: the settings read from arguments and the environment, resume records, the
OpenTelemetry names without a public home. Imports only signals.
"""
