"""The public facade: Tracking, trace_state, the generations/table loggers, RLInsightLogger. Imports
distributed and below.
"""
