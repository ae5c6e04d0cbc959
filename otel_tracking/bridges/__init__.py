"""The trackers in a child process: the link (the training process's side), the child, the wire
messages. Imports delivery and below.
"""
