{{- define "kubetrain.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kubetrain.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kubetrain.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kubetrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kubetrain.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kubetrain.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{- define "kubetrain.trainerImage" -}}
{{- printf "%s:%s" .Values.trainer.image.repository (default .Chart.AppVersion .Values.trainer.image.tag) -}}
{{- end -}}

{{- /*
"true" when the operator elects a leader: more than one replica, or asked for.
*/ -}}
{{- define "kubetrain.leaderElection" -}}
{{- if or (gt (int .Values.operator.replicas) 1) .Values.operator.leaderElection.enabled -}}true{{- end -}}
{{- end -}}

{{- define "kubetrain.leaseName" -}}
{{- printf "%s-leader" (include "kubetrain.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /*
The peers that may reach the trainers' metrics port (the operator's --metrics-from-json): the
operator's own pods (it reads each job's progress there) and networkPolicy.metricsFrom.
*/ -}}
{{- define "kubetrain.metricsFrom" -}}
{{- $namespace := dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace) -}}
{{- $pods := dict "matchLabels" (include "kubetrain.selectorLabels" . | fromYaml) -}}
{{- $operator := dict "namespaceSelector" $namespace "podSelector" $pods -}}
{{- prepend .Values.networkPolicy.metricsFrom $operator | toJson -}}
{{- end -}}
