"""Builds the compiled cores: the history drafter's and the rollout simulator's event loop
(everything else is in pyproject.toml)."""
from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(ext_modules=[Pybind11Extension("rhymerl.drafting._suffix_core", ["rhymerl/drafting/_suffix_core.cpp"],
                                     cxx_std=17, extra_compile_args=["-O3"]),
                   Pybind11Extension("rhymerl.scheduling._simulator_core", ["rhymerl/scheduling/_simulator_core.cpp"],
                                     cxx_std=17, extra_compile_args=["-O3"])])
