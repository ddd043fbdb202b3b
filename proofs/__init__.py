"""proofs: written proofs and mechanical certificates for muon_ref and muon_dist."""
