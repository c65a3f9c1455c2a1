"""Peers measured beside tierlm (llama.cpp): finding a build, preparing its files, running its benchmark."""
