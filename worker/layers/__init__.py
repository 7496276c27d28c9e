"""TP-ready layers: parallel linears, vocab-parallel embedding, norms, rotary, attention."""
