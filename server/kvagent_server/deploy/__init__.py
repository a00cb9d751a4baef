"""Deployment rendering: Kubernetes manifests and a compose file from the bundle config."""

from kvagent_server.deploy.compose import render_compose
from kvagent_server.deploy.kubernetes import render_kubernetes
from kvagent_server.deploy.options import DeployOptions, load_options
from kvagent_server.deploy.plan import DeployPlan, deploy_plan

__all__ = ["DeployOptions", "DeployPlan", "deploy_plan", "load_options", "render_compose",
           "render_kubernetes"]
