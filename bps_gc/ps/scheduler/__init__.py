"""The scheduler: the address book, the worker hosts and the job's end."""
