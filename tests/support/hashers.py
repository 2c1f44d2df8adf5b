"""A cheap password hasher for tests: Django's default PBKDF2 takes about half a second of CPU
per password (by design), and the fixtures create several users per test.

Same algorithm name as Django's, so a hash made here is verified by an unmodified server
process (the browser tests' gunicorn), which reads the iteration count from the hash."""

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class FastPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    iterations = 1_000
