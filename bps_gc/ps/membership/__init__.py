"""What every node runs beside its role: the membership (joins, departures, failures) and the event loop."""
