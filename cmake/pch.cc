// Translation unit that carries the precompiled header (see cmake/pch.h).
