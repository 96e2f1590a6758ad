"""What peers say to the daemon, as types: the enums the wire's strings stand for."""
