"""What users would pick instead of memsafe: faiss, KeOps, hand-chunked JAX, chunked attention.

Each peer module imports its optional dependency lazily and raises ImportError naming the
package when it is missing, so the runner can record the peer as unavailable.
"""
