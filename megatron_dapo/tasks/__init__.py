"""Small synthetic tasks with rule rewards (the embedded CPU demo uses ``arithmetic``)."""
