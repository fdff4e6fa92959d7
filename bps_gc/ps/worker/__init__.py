"""A worker: the PS communicator (push_pull), its I/O, its peers and its local and host levels."""
