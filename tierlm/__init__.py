"""tierlm: fine-tune and serve language models larger than memory."""
