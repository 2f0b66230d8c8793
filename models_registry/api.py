"""GET /api/v1/models/: the registered manifests."""
from __future__ import annotations

from rest_framework import generics, serializers

from models_registry.models import ModelManifest


class ManifestSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelManifest
        fields = ["model_id", "tier", "cost", "capabilities", "pipeline", "source", "params_schema"]


class ModelListView(generics.ListAPIView):
    """Every registered model, cheapest first."""

    serializer_class = ManifestSerializer
    queryset = ModelManifest.objects.order_by("cost", "model_id")
    pagination_class = None
