"""The scheduler framework: filters drop candidates, scorers rate them, a picker orders them."""
