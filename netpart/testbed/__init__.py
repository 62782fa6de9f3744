"""Emulated machines: how can M dedicated machines be tried on this one? A network
namespace per machine on a shaped
switch (`netns`), and a cpu cgroup per machine holding it to a share of a core (`cgroups`).
Needs root; each module's `unavailable()` says why it cannot be used here.
"""
