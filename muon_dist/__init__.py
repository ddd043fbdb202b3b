"""muon_dist: distributed Muon on DTensor / FSDP2 shards, checked against muon_ref."""
