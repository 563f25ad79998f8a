"""Lossless coding stages: rANS (rans.py) and Rice sub-streams (rice.py), each with a textbook reference decoder first and its checksum."""
