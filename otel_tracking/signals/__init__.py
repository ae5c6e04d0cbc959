"""The data itself: log() values and steps, ids, redaction, the ml.* names, the W3C carrier. Imports
nothing of otel_tracking's outside this package.
"""
