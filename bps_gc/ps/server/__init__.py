"""A server: sums or reduces each key's pushes and answers the pulls."""
