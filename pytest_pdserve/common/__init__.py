"""Building blocks every layer uses, stdlib only: numbers in user text, redaction, safe file writes, deadlines,
resource limits.
"""
