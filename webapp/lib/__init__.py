"""Small helpers shared by the apps."""
