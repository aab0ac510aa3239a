"""events: the outbox of what happened to an owner's jobs, and its feed"""
