"""Accounts: personal API tokens for scripts, and the profile page where users manage them."""
