"""The Ray Serve application of kvrank: ingress, user-state store and ranker replicas."""
