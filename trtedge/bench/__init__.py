"""`trtedge bench`: workloads, a load generator, latency metrics and reports, offline or over HTTP."""
