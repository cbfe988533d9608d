"""The service-class benchmark: interactive chat while batch work overloads the fleet."""
