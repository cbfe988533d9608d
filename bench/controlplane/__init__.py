"""The control-plane benchmark: change-to-ACK latency, scale and memory of kvpilot's ADS."""
