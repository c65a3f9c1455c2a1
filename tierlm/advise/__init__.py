"""`tierlm plan`: measures this machine where asked (tierlm.bench), asks tierlm.plan for placements,
times and costs, and prints, charts and writes them."""
